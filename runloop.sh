export KERAS_RING_TIMEOUT_SECONDS=30 TF_CPP_MIN_LOG_LEVEL=3 NR=${2:-2}
cd /tmp/hunt
timeout 300 /work/main/.venv/bin/python loop.py ref $1 2>&1 | grep -E "REF|Error" | tail -3
timeout 300 /work/main/.venv/bin/mpirun -np $NR /work/main/.venv/bin/python loop.py dist $1 2>&1 | grep -E "DIST|Error" | tail -6
echo "rc=${PIPESTATUS[0]}"
