"""The `atom` command line."""

from __future__ import annotations

import argparse


def _demo(args: argparse.Namespace) -> None:
    from atom.demo import run_demo

    run_demo(args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom", description="ATOM: LLM models, kernels and engine"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="build a tiny random model locally and generate with it"
    )
    demo.add_argument("--out", help="folder for the demo checkpoint (default: a temporary one)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
