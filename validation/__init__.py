"""Forward checks of a ported transformer on a target device against a higher-precision golden."""
