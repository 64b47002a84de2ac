import sys

# Guarded: ranks spawned by `calibrate` import the main module again as __mp_main__.
if __name__ == "__main__":
    from autoshard.tools.cli import main

    sys.exit(main())
