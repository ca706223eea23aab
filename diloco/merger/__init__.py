"""The outer merger: quorum, grace, validate, fold, outer step, commit."""
