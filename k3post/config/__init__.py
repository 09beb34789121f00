"""Typed recipes: YAML → frozen pydantic models; unknown keys, wrong types and dangling
references are errors that name the file and the key path."""
