"""`python -m pdcore ...` is `pdserve ...`."""

from __future__ import annotations

from pdcore.cli import main

if __name__ == "__main__":
    main()
