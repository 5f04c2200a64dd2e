"""What the ranks left behind, turned into the record's measured figures (pure: no torch): aggregation
over ranks, communication from traces and the flight recorder, statistics, measured/predicted ratios."""
