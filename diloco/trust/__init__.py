"""Trust: who may publish and what a merge takes — signing, the guard's fold, the judge and its validation,
the outlier statistic, least-privilege bucket policies, and the view of a run's guard now (docs/TRUST.md)."""
