"""Training losses as pure functions: DSpark / DFlash (dspark.py), Eagle3's training-time test
(eagle3.py), MTP-1 (mtp.py), plain next-token LM loss (lm.py)."""
