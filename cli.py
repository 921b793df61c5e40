"""`python -m cli` from a checkout of this repository. The command line lives in `surgery/cli.py` and is installed as
the `surgery` command; this file is not installed (a top-level module named `cli` would collide with other
packages' in site-packages)."""

from surgery.cli import cli, main  # noqa: F401

if __name__ == "__main__":
    main()
