"""Failure across the job: the watch that aborts a rank's other groups when any rank of
the job fails, the settings agreement, and a stall's one hang report."""
