"""Regenerate every shown output of README.md and the documentation (``docs/``): each fenced
block whose first line is ``$ COMMAND`` gets COMMAND's output (run with this checkout's
memcalc), so the pages show what their commands print on this machine. The tests run each
block and compare (``tests/test_shown_outputs.py``).

    python tools/shown_outputs.py                  # rewrite the pages in place
    python tools/shown_outputs.py docs/guides/x.md # only these pages
    python tools/shown_outputs.py --check          # exit 1 if any block differs, naming it

The outputs are those of one torch release, ``TORCH``, and one release of each library the
pages trace, ``PACKAGES``: a kernel's choice and a backward's temporaries follow the
installed torch's rules, and a traced Hugging Face or torchtitan model is named by the lines
of the library's own files, so the pages are rewritten, and checked, only under all of them
(the releases ``.ci/run`` pins).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "2.15"
"""The torch release the pages' outputs were printed with (the release ``.ci/run`` pins)."""
PACKAGES = {"transformers": "5.25.0", "torchtitan": "0.3.0"}
"""The releases of the libraries the pages trace that they were printed with (``.ci/run``
pins them too)."""
BLOCK = re.compile(r"```\n\$ (?P<cmd>[^\n]+)\n(?P<out>.*?)```", re.S)


def pages() -> list[Path]:
    """README.md and every Markdown page of ``docs/``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[tuple[str, str]]:
    """``(command, shown output)`` of each ``$ COMMAND`` block of ``page``."""
    return [(m["cmd"], m["out"]) for m in BLOCK.finditer(page.read_text())]


def output(command: str) -> str:
    """What ``command`` prints (stdout and stderr), ``memcalc`` being this checkout's."""
    shell = command.replace("memcalc ", f"{sys.executable} -m memcalc.cli ")
    # ``python`` too is this interpreter (``python -m memcalc.validation...`` blocks)
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    env.pop("COLUMNS", None)  # as the command says, or the piped width
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # as the command says
        env.pop(name, None)
    done = subprocess.run(shell, shell=True, cwd=ROOT, env=env, capture_output=True, text=True)
    text = done.stdout + done.stderr
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def installed(package: str) -> str | None:
    """The installed release of ``package`` (``2.15.0+cu132``), None without it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def installed_torch() -> str | None:
    """The installed torch's ``major.minor`` (``2.15.0+cu132``: ``2.15``), None without it."""
    release = installed("torch")
    return ".".join(release.split("+")[0].split(".")[:2]) if release else None


def unlike_the_pages() -> str | None:
    """Why this environment cannot print the pages' outputs (another torch or transformers
    than theirs), or None."""
    if installed_torch() != TORCH:
        return (f"the pages show torch {TORCH}'s outputs; torch {installed_torch()} is "
                f"installed (pip install torch=={TORCH}.*)")
    for package, release in PACKAGES.items():
        if installed(package) != release:
            return (f"the pages show {package} {release}'s outputs; {package} "
                    f"{installed(package)} is installed (pip install {package}=={release})")
    return None


def main() -> int:
    why = unlike_the_pages()
    if why is not None:
        print(f"shown_outputs.py: {why}", file=sys.stderr)
        return 2
    differ = 0
    named = {(ROOT / a).resolve() for a in sys.argv[1:] if not a.startswith("--")}
    for page in [p for p in pages() if not named or p.resolve() in named]:
        old = page.read_text()
        new = BLOCK.sub(lambda m: f"```\n$ {m['cmd']}\n{output(m['cmd'])}```", old)
        if new != old:
            differ += 1
            print(f"{page.relative_to(ROOT)}: a shown output differs", file=sys.stderr)
            if "--check" not in sys.argv:
                page.write_text(new)
    return int(differ > 0 and "--check" in sys.argv)


if __name__ == "__main__":
    sys.exit(main())
