"""Integrations with other libraries, each imported on its own (each needs its library):

- :mod:`compilemask.integrations.transformers`: a Hugging Face transformers attention
  backend, ``attn_implementation="compilemask"``.
"""
