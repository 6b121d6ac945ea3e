"""Tests of psring/core/: frames, arrays, the fold, compression."""
