"""What a rank would hold, found with the real code but without a real run: the fake-process-group
simulation behind `partrain plan --simulate`, and measurements of a real model's bytes that the
planner's formulas are checked against."""
