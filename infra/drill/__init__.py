"""The incident drill: the whole system, end to end, on the local stand-in (``sdcguard drill``)."""
