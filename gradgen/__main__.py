"""``python -m gradgen`` is the same program as ``gradgen``."""

from gradgen.cli import main

if __name__ == "__main__":
    main()
