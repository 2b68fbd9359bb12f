"""What an input is: one `Source` per argument, opened once (`source`), its family worked out (`detect`), an
adapter's keys sorted into modules (`adapter_keys`). Everything above reads inputs through it."""

from porting.inputs.source import Kind, Source, SourceLike, Stamp, as_source, open_source, shown, stamp_files

__all__ = ["Kind", "Source", "SourceLike", "Stamp", "as_source", "open_source", "shown", "stamp_files"]
