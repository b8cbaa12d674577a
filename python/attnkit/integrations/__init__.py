"""attnkit inside other libraries' attention plug-in points.

- ``attnkit.integrations.transformers.register()``: ``attn_implementation="attnkit"`` for
  Hugging Face transformers models (the attention function and its mask function).
- ``attnkit.integrations.diffusers.register()``: attnkit as a backend of diffusers'
  attention dispatcher (exact, and Sage as an opt-in).

Each module imports its library only when used; attnkit does not depend on either.
"""
