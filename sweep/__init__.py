"""The parts of sweep_report.py, one concern each, imported one way: lines.py reads and
checks the lines a sweep wrote and names, keys and orders its runs; predict.py turns a
simulated rank's measured compute and counted bytes into a predicted step; settings.py
picks, of the settings a run tried, the one shown; plan.py lists the runs run_all.sh
makes; pictures.py takes the report's numbers from the lines and draws its five
pictures. sweep_report.py makes the table, the verdict and REPORT.md of them, and is the
command line run_all.sh calls."""
