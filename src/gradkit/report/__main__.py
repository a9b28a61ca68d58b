"""``python -m gradkit.report RUN_DIR``: draw a run's gradient report (see :func:`gradkit.report.figure.main`)."""

from gradkit.report.figure import main

if __name__ == "__main__":
    main()
