"""`python -m porting.families shapes FAMILY`: regenerate a family's diffusers shape data from diffusers."""

import sys

from .generate_shapes import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["shapes"] or len(sys.argv) < 3:
        sys.exit("usage: python -m porting.families shapes FAMILY [--print]")
    main(sys.argv[2:])
