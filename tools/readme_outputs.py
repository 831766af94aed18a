"""Regenerate every shown output of README.md: each fenced block whose first line is
``$ COMMAND`` gets COMMAND's output (run with this checkout's memcalc), so the README shows
what its commands print on this machine.

    python tools/readme_outputs.py          # rewrite README.md in place
    python tools/readme_outputs.py --check  # exit 1 if any block differs
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```\n\$ (?P<cmd>[^\n]+)\n(?P<out>.*?)```", re.S)


def output(command: str) -> str:
    """What ``command`` prints (stdout and stderr), ``memcalc`` being this checkout's."""
    shell = command.replace("memcalc ", f"{sys.executable} -m memcalc.cli ")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(shell, shell=True, cwd=ROOT, env=env, capture_output=True, text=True)
    text = done.stdout + done.stderr
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def main() -> int:
    path = ROOT / "README.md"
    old = path.read_text()
    new = BLOCK.sub(lambda m: f"```\n$ {m['cmd']}\n{output(m['cmd'])}```", old)
    if "--check" in sys.argv:
        return int(new != old)
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
