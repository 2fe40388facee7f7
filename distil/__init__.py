"""Tools that train small speculators for the tests and benches, on the CPU in minutes.

No public EAGLE-3 head or MTP checkpoint small enough for the test machines is reachable from them, so
`make models` makes one of each here (`python -m distil.eagle3`, `python -m distil.mtp`). They are training
scripts, not part of the library: they depend on `calibrate`, and `calibrate` never imports them (the
library is kept free of upward imports), which is why they live in a package of their own beside it.
"""
