"""KIVI (kivi1, kivi2, kivi3, kivi4): the packed base alone, which every other format builds on (formats/base.py
holds its behaviour as the defaults). Keys per channel over a page, values per token and channel group, the open
page and the recent window R in fp16 frames."""

from __future__ import annotations

from sgl_kvq.formats.base import Format


class Kivi(Format):
    family = "kivi"
    bits = (1, 2, 3, 4)


FORMAT = Kivi()
