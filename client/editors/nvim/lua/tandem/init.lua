-- tandem.nvim: inline completion (fill in the middle) and chat from a local
-- tandem daemon, through its OpenAI-compatible bridge (`tandem http`).
--
--   require("tandem").setup({ url = "http://127.0.0.1:8642/v1" })
--   vim.keymap.set("i", "<C-]>", require("tandem").complete)
--
-- :TandemComplete       insert a completion at the cursor (the text after the
--                       cursor is sent too: the model fills in the middle)
-- :[range]TandemChat Q  ask Q (with the selected lines, if any) in a chat buffer;
--                       the answer streams in. :TandemChatReset forgets the chat.
--
-- Needs Neovim >= 0.7 and curl. Nothing leaves the machine: the bridge listens
-- on loopback only.

local M = {}

M.config = {
  url = "http://127.0.0.1:8642/v1", -- the bridge (tandem http --listen ...)
  max_tokens = 128, -- per completion
  max_lines = 0, -- stop a completion after this many lines; 0 = no limit
  stop_at_blank_line = true, -- stop a completion before a blank line
  temperature = 0, -- completions: greedy
  chat_max_tokens = 1024,
  chat_temperature = 0.7,
  timeout_ms = 60000,
  curl = "curl",
}

local state = { busy = 0, history = {}, chat_buf = nil, last = nil }

-- POST `body` (a table) to the bridge; `on_event(obj)` gets each JSON object
-- (one for a plain answer; one per server-sent event when streaming) except
-- errors, `on_exit(ok, err)` the end (err: the bridge's error message, or why
-- it could not be reached). Returns the job id.
local function post(path, body, on_event, on_exit)
  local cmd = {
    M.config.curl, "-sS", "-N", "--max-time", tostring(math.ceil(M.config.timeout_ms / 1000)),
    "-H", "Content-Type: application/json", "--data-binary", "@-", M.config.url .. path,
  }
  local pending, whole, err, finished = "", {}, nil, false
  local function event(obj)
    if type(obj) == "table" and type(obj.error) == "table" then
      err = tostring(obj.error.message)
    elseif type(obj) == "table" then
      on_event(obj)
    end
  end
  local function line(text)
    if body.stream then
      local data = text:match("^data: (.*)$")
      if data == nil then return end
      if data == "[DONE]" then finished = true return end
      local ok, obj = pcall(vim.json.decode, data)
      if ok then event(obj) end
    else
      table.insert(whole, text)
    end
  end
  state.busy = state.busy + 1
  local job = vim.fn.jobstart(cmd, {
    on_stdout = function(_, data)
      -- data: lines; the first continues the previous call's last (partial) one
      data[1] = pending .. data[1]
      pending = table.remove(data)
      for _, text in ipairs(data) do line(text) end
    end,
    on_stderr = function(_, data)
      local text = table.concat(data, "\n")
      if text:match("%S") then err = (err or "") .. text end
    end,
    on_exit = function(_, code)
      if pending ~= "" then line(pending) end
      state.busy = state.busy - 1
      if not body.stream then
        local ok, obj = pcall(vim.json.decode, table.concat(whole, "\n"))
        if ok and type(obj) == "table" then event(obj) elseif code == 0 then err = err or "the bridge's answer is not JSON" end
      end
      if code ~= 0 then
        err = (err or ("curl exited with " .. code)) .. " (is `tandem http` running at " .. M.config.url .. "?)"
      elseif body.stream and not finished and not err then
        err = "the stream ended early"
      end
      vim.schedule(function() on_exit(err == nil, err) end)
    end,
  })
  if job <= 0 then
    state.busy = state.busy - 1
    vim.schedule(function() on_exit(false, "could not run " .. M.config.curl) end)
    return job
  end
  vim.fn.chansend(job, vim.json.encode(body))
  vim.fn.chanclose(job, "stdin")
  return job
end

-- The file's text before and after the cursor (with the newline that ends the
-- file when it is written, as the model saw files in training).
local function around_cursor(buf, row, col)
  local lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false)
  local current = lines[row] or ""
  local before = table.concat(vim.list_slice(lines, 1, row - 1), "\n")
  local after = table.concat(vim.list_slice(lines, row + 1), "\n")
  local prefix = (row > 1 and before .. "\n" or "") .. current:sub(1, col)
  local suffix = current:sub(col + 1) .. (row < #lines and "\n" .. after or "")
  if vim.bo[buf].eol or vim.bo[buf].fixeol then suffix = suffix .. "\n" end
  return prefix, suffix
end

-- Insert a completion at the cursor. opts.sync: wait for it (for scripts and
-- tests). opts.on_done(text|nil, err). A completion that arrives after the
-- buffer changed is dropped (it was for other text).
function M.complete(opts)
  opts = opts or {}
  local buf = vim.api.nvim_get_current_buf()
  local win = vim.api.nvim_get_current_win()
  local row, col = unpack(vim.api.nvim_win_get_cursor(win))
  local tick = vim.api.nvim_buf_get_changedtick(buf)
  local prefix, suffix = around_cursor(buf, row, col)
  local done, text = false, nil
  post("/completions", {
    model = "tandem",
    prompt = prefix,
    suffix = suffix,
    max_tokens = M.config.max_tokens,
    temperature = M.config.temperature,
    max_lines = M.config.max_lines,
    stop_at_blank_line = M.config.stop_at_blank_line,
  }, function(obj)
    if obj.choices and obj.choices[1] then text = obj.choices[1].text end
  end, function(ok, err)
    done = true
    if not ok then vim.notify("tandem: " .. err, vim.log.levels.ERROR) end
    state.last = { text = text, error = err }
    if text and text ~= "" and vim.api.nvim_buf_is_valid(buf) and vim.api.nvim_buf_get_changedtick(buf) == tick then
      local new = vim.split(text, "\n", { plain = true })
      vim.api.nvim_buf_set_text(buf, row - 1, col, row - 1, col, new)
      if vim.api.nvim_win_is_valid(win) and vim.api.nvim_win_get_buf(win) == buf then
        local end_row = row + #new - 1
        local end_col = (#new == 1 and col or 0) + #new[#new]
        vim.api.nvim_win_set_cursor(win, { end_row, end_col })
      end
    elseif text and text ~= "" then
      state.last.error = "dropped: the buffer changed while the completion was on its way"
    end
    if opts.on_done then opts.on_done(text, err) end
  end)
  if opts.sync then
    vim.wait(M.config.timeout_ms + 1000, function() return done end, 20)
  end
end

local function chat_buffer()
  if not (state.chat_buf and vim.api.nvim_buf_is_valid(state.chat_buf)) then
    local buf = vim.api.nvim_create_buf(false, true)
    vim.api.nvim_buf_set_name(buf, "tandem://chat")
    vim.api.nvim_buf_set_option(buf, "filetype", "markdown")
    state.chat_buf = buf
  end
  if vim.fn.bufwinid(state.chat_buf) == -1 then
    vim.cmd("botright split")
    vim.api.nvim_win_set_buf(0, state.chat_buf)
  end
  return state.chat_buf
end

local function append(buf, text)
  local last = vim.api.nvim_buf_line_count(buf)
  local tail = vim.api.nvim_buf_get_lines(buf, last - 1, last, false)[1] or ""
  local parts = vim.split(text, "\n", { plain = true })
  parts[1] = tail .. parts[1]
  vim.api.nvim_buf_set_lines(buf, last - 1, last, false, parts)
  local win = vim.fn.bufwinid(buf)
  if win ~= -1 then vim.api.nvim_win_set_cursor(win, { vim.api.nvim_buf_line_count(buf), 0 }) end
end

-- Ask `question` in the chat buffer; `context` (lines) is sent with it as a
-- fenced block. The answer streams into the buffer. opts.sync: wait for it.
function M.chat(question, context, opts)
  opts = opts or {}
  local content = question
  if context and #context > 0 then
    content = question .. "\n\n```" .. vim.bo.filetype .. "\n" .. table.concat(context, "\n") .. "\n```"
  end
  local buf = chat_buffer()
  local first = vim.api.nvim_buf_line_count(buf) == 1 and vim.api.nvim_buf_get_lines(buf, 0, 1, false)[1] == ""
  append(buf, (first and "" or "\n\n") .. "## You\n\n" .. content .. "\n\n## tandem\n\n")
  table.insert(state.history, { role = "user", content = content })
  local answer, done = {}, false
  post("/chat/completions", {
    model = "tandem",
    messages = state.history,
    stream = true,
    max_tokens = M.config.chat_max_tokens,
    temperature = M.config.chat_temperature,
  }, function(obj)
    local choice = obj.choices and obj.choices[1]
    local piece = choice and choice.delta and choice.delta.content
    if type(piece) == "string" and piece ~= "" then
      table.insert(answer, piece)
      vim.schedule(function() if vim.api.nvim_buf_is_valid(buf) then append(buf, piece) end end)
    end
  end, function(ok, err)
    done = true
    if not ok then vim.notify("tandem: " .. err, vim.log.levels.ERROR) end
    table.insert(state.history, { role = "assistant", content = table.concat(answer) })
    state.last = { text = table.concat(answer), error = err }
    if opts.on_done then opts.on_done(state.last.text, err) end
  end)
  if opts.sync then
    vim.wait(M.config.timeout_ms + 1000, function() return done end, 20)
  end
end

function M.chat_reset()
  state.history = {}
  if state.chat_buf and vim.api.nvim_buf_is_valid(state.chat_buf) then
    vim.api.nvim_buf_set_lines(state.chat_buf, 0, -1, false, { "" })
  end
end

-- Requests in flight (0 when idle), and the last answer: { text, error }.
function M.busy() return state.busy end
function M.last() return state.last end

function M.setup(opts)
  M.config = vim.tbl_deep_extend("force", M.config, opts or {})
end

return M
