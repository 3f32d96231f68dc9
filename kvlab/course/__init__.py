"""The course's own material, not engine code: the notebooks' checks.

    checks          what every test cell compares with ("yours" against "expected"), loaded afresh by each cell
    kernel_checks   Chapter 7's: NaN-trapped batches, a launch that records every load, per-sequence verdicts

A test cell loads these files from disk each time it runs (importlib, not the cached module), so a
notebook that redefines a check changes nothing in grading.
"""
