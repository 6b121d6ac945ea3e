"""Tests of psring/cluster/: daemons and jobs, the compose cluster on a real Docker engine."""
