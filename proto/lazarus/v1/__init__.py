"""Generated stubs of lazarus/v1/lazarus.proto (regenerate: python -m lazarus.proto.generate)."""
