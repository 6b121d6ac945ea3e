"""What the tests run besides themselves: rank scripts (``jobs``) and the long-form harnesses (``harness``)."""
