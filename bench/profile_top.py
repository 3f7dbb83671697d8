"""Summarise py-spy collapsed stacks: where the sampled time goes.

Usage: .venv/bin/python bench/profile_top.py stacks.txt [--top 30]
Prints, per thread, its share of samples, then the functions with the most
self time and the most inclusive time (over all threads).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def short(frame: str) -> str:
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m["file"]
    for marker in ("site-packages/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m['func']} ({path})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stacks")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    with open(args.stacks) as lines:
        for line in lines:
            stack, _, count_text = line.rstrip().rpartition(" ")
            if not stack:
                continue
            count = int(count_text)
            frames = stack.split(";")
            total += count
            threads[frames[0]] += count
            names = [short(f) for f in frames[1:]] or [frames[0]]
            own[names[-1]] += count
            for name in set(names):
                incl[name] += count
    print(f"{total} samples")
    for name, count in threads.most_common():
        print(f"{100 * count / total:6.1f}%  {name}")
    print("\nself time")
    for name, count in own.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")
    print("\ninclusive time")
    for name, count in incl.most_common(args.top):
        print(f"{100 * count / total:6.1f}%  {name}")


if __name__ == "__main__":
    main()
