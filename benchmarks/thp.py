"""torch's own huge pages for large CPU tensors (``THP_MEM_ALLOC_ENABLE=1``), measured.

Times ``get_logprobs_for_tokens`` forward + backward at ``(B, T, V)`` (default (4, 512, 32000):
a 250 MiB gradient, allocated and written every call), each setting in fresh processes,
alternating: ``python benchmarks/thp.py [--rounds N]``. Prints the median per setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import time, torch, klpen
g = torch.Generator().manual_seed(0)
z = torch.randn({b}, {t}, {v}, generator=g).requires_grad_()
y = torch.randint(0, {v}, ({b}, {t}), generator=g)
klpen.get_logprobs_for_tokens(z, y).sum().backward()
best = float("inf")
for _ in range(3):
    z.grad = None
    t0 = time.perf_counter()
    klpen.get_logprobs_for_tokens(z, y).sum().backward()
    best = min(best, time.perf_counter() - t0)
print(best * 1e3)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", default="4,512,32000")
    args = parser.parse_args()
    b, t, v = (int(x) for x in args.shape.split(","))
    code = CHILD.format(b=b, t=t, v=v)
    times: dict[str, list[float]] = {"torch.empty": [], "THP_MEM_ALLOC_ENABLE=1": []}
    for _ in range(args.rounds):
        for name in times:
            env = dict(os.environ)
            env.pop("THP_MEM_ALLOC_ENABLE", None)
            if name != "torch.empty":
                env["THP_MEM_ALLOC_ENABLE"] = "1"
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            times[name].append(float(out.stdout.strip()))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"({b}, {t}, {v}) fp32 fwd+bwd, best of 3 calls per process, {args.rounds} rounds")
    print(stamp)
    for name, values in times.items():
        each = ", ".join(f"{x:.0f}" for x in values)
        print(f"{name}: median {statistics.median(values):.1f} ms ({each})")


if __name__ == "__main__":
    main()
