"""The names of the publishable pipeline variants, as plain data.

`port publish --help` lists them as the `--variant` choices; importing the family registry (`porting.families`) to
read them would cost more than the rest of the help. tests/test_cli_startup.py keeps this tuple equal to the
registry's `pipeline_variants()`, names and order: a family that adds a variant adds its name here too.
"""

PIPELINE_VARIANTS: tuple[str, ...] = ("flux1-dev", "flux1-schnell", "klein", "klein-kv", "dev")
