def progress_line(row):
  return str(row)
