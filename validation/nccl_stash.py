"""Two facts of NCCL's functional collectives, measured on one GPU with a group of one rank.

    python validation/nccl_stash.py [OUT.json]      # on a GPU

memcalc's tracer runs the functional collectives as NCCL does (``memcalc/tracing/
collectives.py``): ``_wrap_tensor_autograd`` returns the output itself (no copy), and from
torch 2.8 on ``ProcessGroupNCCL`` keeps an async collective's inputs alive until it is
waited on (pytorch/pytorch#150398). Both are read from PyTorch's source; this measures them.
For ``all_gather_tensor`` and ``all_to_all_single`` on a 4 MiB input whose last reference is
dropped right after the call: allocated memory after the call, after ``del`` of the input
(input + output: the input is stashed; output only: it is not), a second later (the
watchdog thread could release the stash once the work completes), and after the wait. And
``dist.all_to_all_single`` called synchronously into a buffer, as DeepSpeed-Ulysses calls
it: its input goes with its last reference.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as ft_c

MIB = 1 << 20


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def one(name: str, collective) -> dict:
    """Memory at each point of one collective whose input dies before the wait."""
    base = allocated()
    x = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    y = collective(x)
    issued = allocated() - base
    del x
    dropped = allocated() - base
    time.sleep(1.0)  # the watchdog thread could release the stash once the work completes
    slept = allocated() - base
    y = y.wait() if hasattr(y, "wait") else y
    waited = allocated() - base
    kind = type(y).__name__
    del y
    return {"collective": name, "after_call": issued, "after_del_input": dropped,
            "after_1s": slept,
            "after_wait": waited, "result_type": kind,
            # the tracer's rules: output 4 MiB, input held to the wait (torch >= 2.8)
            "stashed": dropped == slept == 8 * MIB and waited == 4 * MIB,
            "no_copy": issued == 8 * MIB}


def synchronous(name: str, collective) -> dict:
    """A synchronous ``torch.distributed`` collective into a buffer made before it, as
    DeepSpeed-Ulysses calls ``all_to_all_single``: the input dropped after the call is freed
    at once (the wait inside the call ends NCCL's stash), 4 MiB left, the output's."""
    base = allocated()
    y = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    x = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    collective(y, x)
    issued = allocated() - base
    del x
    dropped = allocated() - base
    del y
    return {"collective": name, "after_call": issued, "after_del_input": dropped,
            "released_with_the_call": issued == 8 * MIB and dropped == 4 * MIB}


def main(out: str) -> None:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    group = dist.group.WORLD
    torch.empty(1, device="cuda")  # the context
    rows = [one("all_gather_tensor", lambda x: ft_c.all_gather_tensor(x, 0, group)),
            one("all_to_all_single", lambda x: ft_c.all_to_all_single(x, None, None, group)),
            synchronous("dist.all_to_all_single",
                        lambda y, x: dist.all_to_all_single(y, x, group=group))]
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "nccl": str(torch.cuda.nccl.version()), "rows": rows}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "nccl-stash.json")
