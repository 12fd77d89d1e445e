"""The served KV formats, one module per family (kivi, specache, gear, logquant, zipcache), each declaring what it
adds to KIVI's packed pages through formats/base.Format; formats/registry.py maps the dtype names to them."""
