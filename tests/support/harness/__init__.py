"""Test harnesses: the long forms of chaos, fuzzing, soak and network-fault runs (short forms run in the suite).

Each is a script: python tests/support/harness/chaos.py --help, and so on.
"""
