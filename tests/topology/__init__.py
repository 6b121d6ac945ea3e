"""Tests of psring/topology/: collectives over both topologies, the data plane, stalls, elastic ps."""
