"""How long the volatile-value scan (``hotprefix.text.volatile.find_volatile``) takes on hostile input,
and how it grows with the input: unclosed placeholders followed by long runs of spaces, tabs or
brackets, which once made its patterns backtrack for minutes (cubic in the run).

For each input shape it times one scan at n and at 4n characters (best of --repeats) and prints the
ratio: a linear scan reads about 4x, a quadratic one 16x, a cubic one 64x.

    .venv/bin/python benchmarks/bench_lint_scan.py [--n 20000] [--repeats 3]

tests/test_lint_templates.py checks what the scan finds on the same inputs; the timing lives here.
"""

from __future__ import annotations

import argparse
import time

from hotprefix.text.volatile import find_volatile

SHAPES = {
    "{{ + spaces": lambda n: "{{ " + " " * n + "x",
    "{abc + spaces": lambda n: "{abc" + " " * n + "x",
    "{abc + space/tab, =": lambda n: "{abc" + " \t" * (n // 2) + "=",
    "${ + letters": lambda n: "${" + "a" * n,
    "{f( + brackets": lambda n: "{f(" + "(" * n,
    "repeated {{ x": lambda n: "{{ x " * n,
    "repeated {a}": lambda n: "{a} " * n,
}


def best_of(text: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        find_volatile(text)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="the run's length (the small input)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"| input | ms at n={args.n:,} | ms at 4n | 4n / n |")
    print("|---|---|---|---|")
    for name, make in SHAPES.items():
        small, large = best_of(make(args.n), args.repeats), best_of(make(4 * args.n), args.repeats)
        print(f"| {name} | {small * 1e3:.1f} | {large * 1e3:.1f} | {large / small:.1f}x |")


if __name__ == "__main__":
    main()
