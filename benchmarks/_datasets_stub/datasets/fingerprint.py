"""`datasets.fingerprint.Hasher`, imported at import time by TRL's DPO and KTO trainers (see __init__)."""

from . import _NotAvailable


class Hasher(_NotAvailable):
    pass
