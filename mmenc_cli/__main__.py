"""`python -m mmenc_cli` runs the CLI."""

from .cli import main

if __name__ == "__main__":  # worker processes re-import the main module; only run the CLI once
    main()
