"""`python cli.py ...` is the same as the `diffkit ...` console script."""
from diffkit.cli import main

if __name__ == "__main__":
    main()
