-- Commands of tandem.nvim (see lua/tandem/init.lua).
if vim.g.loaded_tandem then
  return
end
vim.g.loaded_tandem = true

vim.api.nvim_create_user_command("TandemComplete", function()
  require("tandem").complete()
end, { desc = "tandem: insert a fill-in-the-middle completion at the cursor" })

vim.api.nvim_create_user_command("TandemChat", function(cmd)
  local context = nil
  if cmd.range > 0 then
    context = vim.api.nvim_buf_get_lines(0, cmd.line1 - 1, cmd.line2, false)
  end
  local question = cmd.args ~= "" and cmd.args or "Explain this code."
  require("tandem").chat(question, context)
end, { nargs = "*", range = true, desc = "tandem: ask in the chat buffer (with the selected lines)" })

vim.api.nvim_create_user_command("TandemChatReset", function()
  require("tandem").chat_reset()
end, { desc = "tandem: forget the chat" })
