-- Closed-loop heartbeats for wrk: PUT /v1/replicas/<id>, cycling through distinct replica ids.
--
--   wrk -t1 -c100 -d10s --latency -s bench/heartbeat.lua http://127.0.0.1:8700 -- <replicas> <body file>
--
-- Ids follow bench/openloop.py's scheme (8 servers per node: n0000-s0 .. n1249-s7 for 10,000).
-- When wrk finishes, one line "WRK_JSON {...}" carries the results for bench/registry_load.py.

local replicas = 10000
local body = '{"node":"n17","server":"s0","endpoint":"http://10.0.0.17:8000","state":"SERVING",'
          .. '"version":3,"target":3,"incarnation":1,"timings":{"pause_s":0.41}}'
local headers = {["Content-Type"] = "application/json"}
local next_id = 0
local threads = {}

function setup(thread)
   thread:set("thread_index", #threads)
   table.insert(threads, thread)
end

function init(args)
   replicas = tonumber(args[1]) or replicas
   if args[2] then
      local f = assert(io.open(args[2], "rb"))
      body = f:read("*a")
      f:close()
   end
   -- Threads start far apart in the id space so they do not beat the same replicas in step.
   next_id = (thread_index or 0) * 7919 % replicas
end

function request()
   local k = next_id
   next_id = (next_id + 1) % replicas
   local path = string.format("/v1/replicas/n%04d-s%d", math.floor(k / 8), k % 8)
   return wrk.format("PUT", path, headers, body)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests":%d,"duration_us":%d,"connect_errors":%d,"read_errors":%d,' ..
      '"write_errors":%d,"non_2xx":%d,"timeouts":%d,"mean_us":%.1f,"max_us":%d,' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p99.9_us":%d}\n',
      summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
      latency.mean, latency.max, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9)))
end
