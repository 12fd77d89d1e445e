"""`sgl-kvq model smollm2|tiny`: materialize an embedded model (once) and print its folder."""

from __future__ import annotations


def add_arguments(p) -> None:
    from bench.models import BUILDERS

    p.add_argument("name", choices=sorted(BUILDERS))


def run(args) -> int:
    from bench.models import BUILDERS

    print(BUILDERS[args.name]())
    return 0
