"""The served KV formats, each declaring what it adds to KIVI's packed pages through formats/base.Format: a package
per family with pages of its own (gear/, logquant/, zipcache/, peers/: declaration and parameters, page codec,
Triton corrections), a module per family without (kivi, specache); formats/registry.py maps the dtype names to
them."""
