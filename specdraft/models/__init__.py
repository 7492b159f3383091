"""Drafter models (DSpark/DFlash block drafters, Eagle-3, the peft standalone drafter) and their export/import."""
