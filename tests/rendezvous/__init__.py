"""Tests of psring/rendezvous/: the store, ranks, launchers, schedulers, ports."""
