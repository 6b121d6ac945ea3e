"""Tests of psring/training/: SyncSGD, the main job, restarts."""
