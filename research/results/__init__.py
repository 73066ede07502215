"""Results of a sweep: running its members (sweep), the tidy table and summary (report) and the
figures (plots), all from the runs' results files alone."""
