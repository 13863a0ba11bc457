"""Allocation programs: traces -> per op segment, the ordered allocations and frees with exact size formulas
(extract.py, sizes.py, fit.py), written and checked as a program set (build.py; read by estimator/programs.py)."""
