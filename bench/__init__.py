"""tiercache's benchmarks: each ``bench/<name>.py`` with a ``main(argv)`` measures one data path
next to a ceiling taken in the same run. ``python -m bench`` lists them (bench/__main__.py);
bench/common.py holds what they share (options, sizes, machine info, results JSON, tables).
"""
