"""The `macinfer` command's entry point. Importing `macinfer` (its first step) has bound
MLX's CPU backend to OpenBLAS already (`macinfer/__init__.py`)."""

from __future__ import annotations


def main() -> None:
    # `import macinfer` (above this module) has bound MLX to OpenBLAS already.
    from macinfer.cli.main import main as cli

    cli()


if __name__ == "__main__":
    main()
