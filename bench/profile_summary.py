"""Summarize a py-spy raw profile (`py-spy record --format raw`, as bench/gpu_multi.sh writes).

    python bench/profile_summary.py logs/D4.Ingress.pyspy.txt [--top 25]

Prints the functions holding the most samples, by own time (the frame on top of the stack)
and inclusive time (anywhere on the stack), as shares of all samples.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def summarize(path: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    lines = [f"{path.name}: {total} samples"]
    for title, counter in (("own", own), ("inclusive", inclusive)):
        lines.append(f"-- {title}")
        lines += [f"{n / total:6.1%}  {frame}" for frame, n in counter.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.profiles:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
