"""What the writer (the dataproxy) and the readers (rollgate, trainers) of a published
trajectory agree on: field names, defaults and packing (docs/trajectory-schema.md).

Pure Python and msgpack only; it imports nothing else of rollgate's, so `services/` and
`rollgate/` may both import it (../shared/STYLE.md, dependency direction).
"""
