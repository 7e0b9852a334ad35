"""A multi-node vLLM group's supervisors: one per host, the head coordinates (`channel`: the
authenticated HTTP channel, `auth`: its message signatures, `membership`: the head's view of
its followers). See docs/multi-node.md."""
