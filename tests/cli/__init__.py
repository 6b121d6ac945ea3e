"""Tests of psring/cli/: the commands' own behaviour (bench)."""
